"""Fine-tune MiniLM-L6 on Rotten Tomatoes in a few lines (same run as rotten_tomatoes.yaml):
    python examples/finetune/finetune_rotten_tomatoes.py
"""
import ember
from ember.callbacks import ModelCheckpoint
from ember.integrations.transformers import ExportBestPretrained, TextClassificationData, TransformersModule
from rotten_tomatoes_data import load_rotten_tomatoes, minilm_path

train, test = load_rotten_tomatoes()                      # 11,752 / 1,000 reviews, fresh | rotten
data = TextClassificationData(minilm_path(), train=train, val=test, test=test, max_length=128, batch_size=32)
module = TransformersModule(minilm_path(), task="sequence-classification", lr=1e-4, warmup_ratio=0.06)
trainer = ember.Trainer(max_steps=300, val_check_interval=0.25, gradient_clip_val=1.0, seed=0,
                        default_root_dir="runs/rotten_tomatoes",
                        callbacks=[ModelCheckpoint(monitor="val/acc", mode="max"),
                                   ExportBestPretrained("runs/rotten_tomatoes/best")])
trainer.fit(module, datamodule=data)
print(trainer.test(module, datamodule=data, ckpt_path="best"))
