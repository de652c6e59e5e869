"""The folder ``vllm-compat run`` puts first on PYTHONPATH: its ``sitecustomize`` activates vllm-compat.

Nothing here is imported as ``vllm_compat._bootstrap`` in normal use; the folder is a package only so that it is
installed with vllm-compat.
"""
