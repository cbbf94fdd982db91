"""CI's CPU job installs the `fms` extra: there a missing ibm-fms must fail loudly, not skip
test_fms.py (which skips cleanly wherever ibm-fms is optional, as on a GPU machine without it)."""

import importlib
import os

import pytest


def test_ci_has_ibm_fms(device):
    if not os.environ.get("CI") or device.type != "cpu":
        pytest.skip("only CI's CPU job must have ibm-fms (the `fms` extra)")
    importlib.import_module("fms")  # ModuleNotFoundError here: CI lost the fms extra
