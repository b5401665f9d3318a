"""`learner.get_weights()` as the source of TorchRL weight-sync senders, on CPU, across processes.

TorchRL's CPU schemes (`MultiProcessWeightSyncScheme`: weights copied through a queue;
`SharedMemWeightSyncScheme`: one shared-memory buffer updated in place) apply what they receive
with `TensorDict.from_module(model)` semantics: a TensorDict nested by module path
(`model` -> `layers` -> `0` -> `self_attn` -> ...). `get_weights()` is flat: one key per Hugging
Face name, dots included (`model.layers.0.self_attn.q_proj.weight`). TorchRL unflattens dotted
keys only for plain dicts (`WeightStrategy.apply_weights`) and in `SharedMemTransport.send_weights`,
not on the scheme's `send()` path nor in the initial sync, so a flat TensorDict fails there with a
KeyError (shown below). The adapter is one call: `flat.unflatten_keys(".")`, the nesting that
`TensorDict.from_module` of the transformers model has (its `rotary_emb` buffers are not
exported; the update writes only the keys it carries).

Each round trip: the scheme's initial sync sends the learner's initial weights, the learner takes
one GRPO update, `send()` pushes the new weights and blocks until the receiver (a spawned process
holding a LlamaForCausalLM built from `hf_config(learner.spec)`) acknowledges; the receiver's
logits must then equal the learner model's (atol 1e-5, as tests/test_weights.py).
"""

from __future__ import annotations

import contextlib
import io
import threading

import pytest
import torch
import torch.multiprocessing as mp
from tensordict import TensorDict, TensorDictBase
from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme
from torchrl.weight_update.weight_sync_schemes import WeightStrategy
from transformers import AutoModelForCausalLM

from tests.support.models import VOCAB, batches, tiny_config
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config

F32 = torch.float32
TIMEOUT_S = 180.0
SCHEMES = {"multiprocess": MultiProcessWeightSyncScheme, "shared_memory": SharedMemWeightSyncScheme}


def as_module_weights(flat: TensorDictBase) -> TensorDictBase:
    """The adapter: HF-named flat weights nested the way `TensorDict.from_module(hf_model)` is."""
    return flat.unflatten_keys(".")


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(7))


def learner_logits(learner: LocalLearner, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return learner.model(x).float()


def hf_receiver_model(config) -> torch.nn.Module:
    """The receiver's model, randomly initialized: only what the scheme delivers makes it match."""
    return AutoModelForCausalLM.from_config(config, dtype=F32).eval()


def _to_bytes(tensor: torch.Tensor) -> bytes:
    # Bytes, not tensors: torch's queue pickling shares tensor memory that dies with the child.
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _receiver(scheme, config, x: torch.Tensor, commands, results) -> None:
    """The receiving process: a transformers model kept in sync by the TorchRL scheme."""
    try:
        torch.manual_seed(123)
        model = hf_receiver_model(config)
        scheme.init_on_receiver(model_id="policy", model=model, worker_idx=0)
        scheme.connect()  # receives and applies the initial weights, starts the receive thread
        while (command := commands.get(timeout=TIMEOUT_S)) != "stop":
            assert command == "logits", command
            with torch.no_grad():
                tied_equal = torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
                results.put(("ok", _to_bytes(model(x).logits), tied_equal))
    except BaseException:
        import traceback

        results.put(("error", traceback.format_exc(), None))
    finally:
        scheme.shutdown()


def _ask_logits(commands, results) -> tuple[torch.Tensor, bool]:
    commands.put("logits")
    status, payload, tied_equal = results.get(timeout=TIMEOUT_S)
    assert status == "ok", payload
    return torch.load(io.BytesIO(payload)), tied_equal


def _send(scheme, weights: TensorDictBase) -> None:
    """`scheme.send` blocks until the receiver acknowledges; a receiver that failed never does
    (TorchRL logs its error and sends no ack), so the wait gets a deadline here."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            scheme.send(weights)
        except BaseException as err:
            errors.append(err)

    sender = threading.Thread(target=run, daemon=True)
    sender.start()
    sender.join(TIMEOUT_S)
    assert not sender.is_alive(), f"the receiver did not acknowledge within {TIMEOUT_S} s"
    if errors:
        raise errors[0]


@contextlib.contextmanager
def synced_receiver(scheme, learner: LocalLearner, x: torch.Tensor):
    """A spawned receiver kept in sync with `learner` through `scheme`; yields the queues to ask
    it for logits, after the initial sync of the learner's current weights."""
    ctx = mp.get_context("spawn")
    scheme.init_on_sender(
        model_id="policy",
        weights=as_module_weights(learner.get_weights(dtype=F32)),
        devices=[torch.device("cpu")],
        ctx=ctx,
    )
    commands, results = ctx.Queue(), ctx.Queue()
    config = hf_config(learner.spec)
    child = ctx.Process(target=_receiver, args=(scheme, config, x, commands, results))
    child.start()
    try:
        scheme.connect()  # the initial sync: the learner's current weights
        yield commands, results
        commands.put("stop")
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        scheme.shutdown()


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
def test_learner_weights_round_trip_through_a_torchrl_scheme(scheme_name):
    learner = LocalLearner(tiny_config("llama3"))
    x = tokens()
    initial_logits = learner_logits(learner, x)
    scheme = SCHEMES[scheme_name]()
    with synced_receiver(scheme, learner, x) as (commands, results):
        received, _ = _ask_logits(commands, results)
        torch.testing.assert_close(received, initial_logits, atol=1e-5, rtol=0)
        learner.update(batches(1)[0])
        assert learner.policy_version == 1
        after_update = learner_logits(learner, x)
        assert not torch.allclose(after_update, initial_logits, atol=1e-4)
        _send(scheme, as_module_weights(learner.get_weights(dtype=F32)))
        received, _ = _ask_logits(commands, results)
        torch.testing.assert_close(received, after_update, atol=1e-5, rtol=0)


def test_tied_embeddings_stay_equal_through_the_scheme():
    """qwen3 ties lm_head to embed_tokens: get_weights() yields both names (one tensor), and the
    receiver's logits follow the update. The initial sync replaces the receiver's parameters with
    the received tensors (`to_module`, one per name), so on torchrl 0.14.1 the receiver's two
    parameters are no longer one object afterwards; every update writes both names with the same
    values, which is what is checked."""
    learner = LocalLearner(tiny_config("qwen3"))
    assert hf_config(learner.spec).tie_word_embeddings
    x = tokens()
    scheme = MultiProcessWeightSyncScheme()
    with synced_receiver(scheme, learner, x) as (commands, results):
        learner.update(batches(1)[0])
        _send(scheme, as_module_weights(learner.get_weights(dtype=F32)))
        received, tied_equal = _ask_logits(commands, results)
        assert tied_equal, "lm_head and embed_tokens differ on the receiver"
        torch.testing.assert_close(received, learner_logits(learner, x), atol=1e-5, rtol=0)


def test_a_flat_tensordict_needs_the_adapter():
    """Why `as_module_weights` exists: TorchRL applies TensorDicts by module path, and does not
    unflatten a TensorDict's dotted keys (a plain dict's, it does)."""
    learner = LocalLearner(tiny_config("llama3"))
    flat = learner.get_weights(dtype=F32)
    strategy = WeightStrategy(extract_as="tensordict")
    model = hf_receiver_model(hf_config(learner.spec))
    with pytest.raises(KeyError, match="Error updating destination"):
        strategy.apply_weights(model, flat)
    strategy.apply_weights(model, as_module_weights(flat))
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, learner_logits(learner, x), atol=1e-5, rtol=0)
    assert isinstance(flat, TensorDict) and all("." in key for key in flat.keys())


def test_send_before_connect_is_refused():
    learner = LocalLearner(tiny_config("llama3"))
    scheme = MultiProcessWeightSyncScheme()
    scheme.init_on_sender(
        model_id="policy",
        weights=as_module_weights(learner.get_weights(dtype=F32)),
        devices=[torch.device("cpu")],
        ctx=mp.get_context("spawn"),
    )
    try:
        with pytest.raises(RuntimeError, match="synchronized on sender"):
            scheme.send(as_module_weights(learner.get_weights(dtype=F32)))
    finally:
        scheme.shutdown()
