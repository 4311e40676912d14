"""The predict loop: ``predict_step`` over each dataloader; under several
processes the outputs are gathered so every rank returns exactly the dataset, in
dataset order (sampler padding dropped)."""
from __future__ import annotations

import inspect
from typing import Any

import torch

from ember.errors import MisconfigurationError
from ember.trainer.data import batch_transfer, count_batches, prepare_batch, start_pass
from ember.trainer.events import Event
from ember.trainer.loops import step_call


def run_predict(t: Any) -> list:
    """``predict_step`` over each of ``trainer.state.eval_dataloaders``; the outputs in
    dataset order (a list per dataloader when there are several)."""
    st, ev, module = t.state, t.events, t.module
    if not callable(getattr(module, "predict_step", None)):
        raise MisconfigurationError(f"{type(module).__name__} has no predict_step; implement it to run predict")
    was_training = module.training
    module.on_predict_model_eval()   # module.eval() unless overridden
    on_start, on_end = ev[Event.ON_PREDICT_BATCH_START], ev[Event.ON_PREDICT_BATCH_END]
    step = step_call(module.predict_step)   # predict_step(batch) works too
    ev(Event.ON_PREDICT_START)
    ev(Event.ON_PREDICT_EPOCH_START)
    all_outputs = []
    loaders = st.eval_dataloaders
    # several dataloaders: predict_step(batch, batch_idx, dataloader_idx) when it takes one
    multi = len(loaders) > 1 and "dataloader_idx" in inspect.signature(module.predict_step).parameters
    with torch.inference_mode() if t.inference_mode else torch.no_grad():
        for dl_idx, loader in enumerate(loaders):
            st.dataloader = loader
            start_pass(t, loader)
            transfer = batch_transfer(t, dl_idx)
            n = count_batches(loader, t.limit_predict_batches)
            st.pass_batches = None   # the whole loader unless limit_predict_batches
            full = t.limit_predict_batches is None or n >= count_batches(loader, None)
            kwargs = {"dataloader_idx": dl_idx} if multi else {}
            outs = []
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= n:
                    break
                batch = prepare_batch(t, batch, transfer)
                st.eval_batch_idx = batch_idx
                if on_start is not None:
                    on_start(batch, batch_idx, dl_idx)
                with t.strategy.precision.forward_context():
                    out = step(batch, batch_idx, **kwargs)
                if on_end is not None:
                    on_end(out, batch, batch_idx, dl_idx)
                outs.append(out)
            st.eval_batch_idx = None
            if t.world_size > 1:
                outs = _gather_outputs(t, outs, loader, full)
            all_outputs.append(outs)
    ev(Event.ON_PREDICT_EPOCH_END)
    ev(Event.ON_PREDICT_END)
    st.dataloader = None
    if was_training:
        module.train()
    return all_outputs[0] if len(all_outputs) == 1 else all_outputs


def _gather_outputs(t, outs: list, loader, full: bool = True) -> list:
    """Concatenate this rank's batch outputs, gather exactly the dataset in order,
    and split it back into batches of the loader's batch size."""
    from ember.distributed import collectives as distributed
    from ember.data.sampling import num_padded
    if not outs or not all(isinstance(o, (torch.Tensor, dict, list, tuple)) for o in outs):
        return outs
    cat = distributed.concat_outputs(outs)
    full = distributed.gather_for_metrics(cat, num_padded=num_padded(loader) if full else 0, strategy=t.strategy)
    bs = getattr(loader, "batch_size", None) or distributed.first_rows(outs[0])
    return distributed.split_outputs(full, bs)
