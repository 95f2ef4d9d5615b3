"""Small models that ship with autopar: the demo's GPT and the MLPs of the test suite."""
