"""Planning a run without torch: the hardware catalog (``hardware``), the model's shape and the
bytes of each precision (``model``), what LoRA trains (``lora``), what a decoder layer saves
(``activations``), what attention and the loss hold (``attention``), the memory model
(``memory``), the step-time model (``timing``), what DPO under LoRA's reference forward adds to
both (``reference``), checking one layout and printing it (``layout``), searching every layout
(``search``) and turning a request with ``auto`` fields into the layout a job runs (``resolve``)."""
