"""Cost model: hardware profiles, compute, communication and memory estimates."""
