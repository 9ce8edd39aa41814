"""`specserve ablate`: draft configurations compared on a live engine (config, runner, report)."""
