from ember.trainer.trainer import Trainer

__all__ = ["Trainer"]
