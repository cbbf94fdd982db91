from fms_paged.generation.generate import generate, validate_prompts
from fms_paged.generation.sampling import sample

__all__ = ["generate", "sample", "validate_prompts"]
