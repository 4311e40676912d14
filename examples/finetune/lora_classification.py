"""LoRA adapters on MiniLM-L6 for Rotten Tomatoes reviews (fresh / rotten), offline:

    python examples/finetune/lora_classification.py                 # about 2 minutes on 2 CPU cores
    python examples/finetune/lora_classification.py --max-steps 5   # a quick look

Only the adapters (r=8 on the attention's query and value) and the classification head
train: about 1% of MiniLM's weights. The checkpoints hold only those (the frozen base is
named by its folder and a digest of its files); the best one is exported as PEFT's adapter
folder, and the live module once more as a plain transformers folder with the adapters
merged in. The model and the reviews ship inside installed packages (see
rotten_tomatoes_data.py).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # rotten_tomatoes_data, next to this file

from peft import LoraConfig

import ember
from ember.callbacks import ModelCheckpoint
from ember.integrations.transformers import ExportBestPretrained, TransformersModule
from rotten_tomatoes_data import RottenTomatoesData, minilm_path

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--max-steps", type=int, default=300)
p.add_argument("--root", default="runs/lora_classification")
args = p.parse_args()
quick = args.max_steps < 50

data = RottenTomatoesData(batch_size=32, train_limit=320 if quick else None, test_limit=64 if quick else None)
lora = LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"])
module = TransformersModule(minilm_path(), task="sequence-classification", lr=5e-4, warmup_ratio=0.06,
                            peft_config=lora)
# a quick look (an epoch of 320 // 32 = 10 steps) validates by its last step, so a best checkpoint exists
trainer = ember.Trainer(max_steps=args.max_steps, val_check_interval=min(args.max_steps, 10) if quick else 0.25, seed=0,
                        gradient_clip_val=1.0, default_root_dir=args.root,
                        callbacks=[ModelCheckpoint(monitor="val/acc", mode="max"),
                                   ExportBestPretrained(os.path.join(args.root, "adapter"))])
trainer.fit(module, datamodule=data)
print(trainer.test(module, datamodule=data, ckpt_path="best", verbose=False))
module.save_pretrained(os.path.join(args.root, "merged"), merged=True)   # AutoModelForSequenceClassification loads it
print(f"adapter folder: {os.path.join(args.root, 'adapter')}  merged model: {os.path.join(args.root, 'merged')}")
