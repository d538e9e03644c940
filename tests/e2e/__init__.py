"""Real-process end-to-end tests: whole jobs with real workers, kills and recoveries."""
