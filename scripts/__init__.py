"""The checkout's scripts (not shipped in the wheel); a package so that `python -m scripts.gpu_check.check`
runs the GPU check's stages from the repository root."""
