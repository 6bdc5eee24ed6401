"""A package (as are speculative/ and vllm/ below it) so that pytest never puts tests/sampler on
sys.path, where the folder vllm/ would stand in for the vllm distribution (``import vllm`` and
``importorskip("vllm")`` would find it where vLLM is not installed)."""
