"""Token selection (lives in `fms_paged.engine.sampling`; re-exported here for `generate` users)."""

from fms_paged.engine.sampling import sample, sample_each

__all__ = ["sample", "sample_each"]
