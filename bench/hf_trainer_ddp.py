"""The dp baseline of ``train_throughput.py`` (part 2): ``transformers.Trainer`` with DDP on gloo,
run as ``torchrun --nproc_per_node N bench/hf_trainer_ddp.py CFG.json``, on the same model and
packed rows as neuron_parallel, timing each step from ``on_step_begin`` to ``on_step_end``."""

import json
import os
import sys
import time

import torch

# The thread count is set before datasets and transformers are imported, as the plain loop
# of train_throughput.py sets it first thing, so both baselines start their threads alike.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
from datasets import load_from_disk  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

cfg = json.loads(open(sys.argv[1]).read())


class PackedRows(torch.utils.data.Dataset):
    """The packed rows of block_size + 1 tokens: inputs, and next-token labels at every position."""

    def __init__(self, path):
        self.rows = load_from_disk(path).with_format("torch")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]["input_ids"]
        # shift_labels: the loss predicts row[t+1] at every input position t, as neuron_parallel does.
        return {"input_ids": row[:-1], "labels": row[:-1], "shift_labels": row[1:]}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.begin, self.end = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.end.append(time.perf_counter())
        if args.process_index == 0:  # one line per step, as train.py appends to metrics.jsonl
            with open(cfg["lines"], "a") as f:
                f.write(json.dumps({"step": state.global_step}) + "\n")


args = TrainingArguments(
    output_dir=cfg["output_dir"],
    per_device_train_batch_size=cfg["mbs"],
    gradient_accumulation_steps=1,
    max_steps=cfg["steps"],
    learning_rate=cfg["lr"],
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=0.0,
    adam_beta1=cfg["betas"][0],
    adam_beta2=cfg["betas"][1],
    adam_epsilon=1e-8,
    max_grad_norm=cfg["max_grad_norm"],
    eval_strategy="no",
    save_strategy="no",
    logging_strategy="no",
    report_to="none",
    disable_tqdm=True,
    dataloader_num_workers=0,
    dataloader_drop_last=True,
    remove_unused_columns=False,
    use_cpu=True,
    ddp_backend="gloo",
    seed=cfg["seed"],
)
model = AutoModelForCausalLM.from_pretrained(cfg["model"])
timer = StepTimer()
trainer = Trainer(model=model, args=args, train_dataset=PackedRows(cfg["dataset"]), callbacks=[timer])
trainer.train()
if args.process_index == 0:
    info = {
        "begin": timer.begin,
        "end": timer.end,
        "world_size": args.world_size,
        "optimizer": type(
            trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        ).__name__,
        "optim": str(args.optim),
        "wrapped": type(trainer.model_wrapped).__name__,
        "threads": torch.get_num_threads(),
    }
    open(cfg["out"], "w").write(json.dumps(info))
