"""Tiny checkpoints of each attention kind at TP=2 (and of each expert kind at EP=2) on the CPU
(float32, gloo): the single device's greedy tokens and routed-experts rows, and its logprobs
within float32 all-reduce tolerance (near-tie flips reported as such: test_tensor_parallel's
check)."""

import pytest

from engine_testing import GREEDY, one_torch_thread  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from test_tensor_parallel import assert_same_generation
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow  # worker processes (torch.distributed ranks)

ENGINE = dict(dtype="float32", max_num_seqs=4, num_kv_blocks=64, max_model_len=256)
# EP=2 splits the attention / recurrent mixers as TP=2 does (expert parallelism spans the
# tensor-parallel ranks), and each expert whole; TP=2 splits every expert's intermediate size
CASES = [
    ("qwen3_moe", "ep"),  # GQA, softmax top-k router (TP=2: the built-in model, test_tensor_parallel)
    ("olmoe", "tp"),  # a q/k norm over all heads (gathered, normed whole)
    ("deepseek_v3", "ep"),  # MLA, grouped sigmoid router with a bias, shared experts
    ("deepseek_v32", "tp"),  # sparse MLA (an indexer)
    ("gpt_oss", "ep"),  # sliding window with sinks, biased interleaved experts
    ("qwen3_next", "tp"),  # Gated DeltaNet hybrid
    ("nemotron_h", "ep"),  # Mamba-2 hybrid, non-gated experts
    ("kimi_linear", "tp"),  # KDA hybrid with MLA
    ("lfm2_moe", "tp"),  # short-convolution hybrid
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-families")
    return {family: str(write_tiny_checkpoint(root / family, family)) for family in dict(CASES)}


@pytest.mark.parametrize("family, mode", CASES)
def test_split_family_equals_one_device(checkpoints, family, mode):
    prompts = [[1 + i * 5 % 200 for i in range(30)], [3 + i * 11 % 200 for i in range(17)]]
    params = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    expected = LLM(checkpoints[family], **ENGINE).generate(prompts, params)
    split = LLM(checkpoints[family], tensor_parallel_size=2, enable_expert_parallel=mode == "ep", **ENGINE)
    try:
        assert_same_generation(expected, split.generate(prompts, params))
    finally:
        split.shutdown()
