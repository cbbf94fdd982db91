"""Token selection (lives in `fms_paged.engine.sampling`; re-exported here for `generate` users)."""

from fms_paged.engine.sampling import check_sampling_args, sample, sample_each

__all__ = ["check_sampling_args", "sample", "sample_each"]
