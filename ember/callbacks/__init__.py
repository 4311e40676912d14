"""Built-in callbacks. Heavy ones import their dependencies lazily."""
from ember.callbacks.base import Callback, Event

_LAZY = {
    "ModelCheckpoint": "ember.callbacks.checkpoint",
    "EarlyStopping": "ember.callbacks.early_stopping",
    "LearningRateMonitor": "ember.callbacks.lr_monitor",
    "RichProgressBar": "ember.callbacks.progress",
    "ProgressBar": "ember.callbacks.progress",
    "Timer": "ember.callbacks.timer",
    "ModelSummary": "ember.callbacks.summary",
    "GatherMetrics": "ember.callbacks.gather_metrics",
    "ThroughputMonitor": "ember.callbacks.throughput",
    "BasePredictionWriter": "ember.callbacks.prediction_writer",
    "BaseFinetuning": "ember.callbacks.finetuning",
    "BackboneFinetuning": "ember.callbacks.finetuning",
}

__all__ = ["Callback", "Event", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ember.callbacks' has no attribute {name!r}")
