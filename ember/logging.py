"""``ember.logging``: Accelerate's ``accelerate.logging`` (``get_logger``: a standard
:mod:`logging` logger whose calls take ``main_process_only=`` and ``in_order=``)."""
from ember.compat.accelerate_logging import MultiProcessAdapter, get_logger

__all__ = ["get_logger", "MultiProcessAdapter"]
