"""Planning a run without torch: the hardware catalog (``hardware``), the model's shape and the
bytes of each precision (``model``), what LoRA trains (``lora``), the memory model (``memory``),
checking one layout and printing it (``layout``), searching every layout (``search``) and turning
a request with ``auto`` fields into the layout a job runs (``resolve``)."""
