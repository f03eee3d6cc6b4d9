"""Each pipeline kind in a folder of its own (`flow`, `lm`): its config, model loading, prompts, adapter, engines,
start-up profile, reference loop and exporter. `kinds.KINDS` points into them; nothing below imports them."""
