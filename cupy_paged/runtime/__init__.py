"""The step plan: turns a scheduled step into the index arrays and resolved launches that
every layer of the step reuses."""
