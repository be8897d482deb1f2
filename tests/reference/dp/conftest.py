"""The recorders here run by hand, where Opacus or TF-Privacy is installed; not collected."""

collect_ignore_glob = ["record_*.py", "tfp_shim.py"]
