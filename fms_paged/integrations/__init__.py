"""Optional integrations with other stacks (each imports its dependency lazily)."""
