"""Why does an extend step not run the compiled pieces? Prints Dynamo's graph breaks and counters."""
import sys
import torch
import tscompile
from tscompile import SamplingParams
from tscompile.counters import counters

torch._logging.set_logs(graph_breaks=True, recompiles=True)
device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
for backend in (["triton", "torch"] if device == "cuda" else ["torch"]):
    llm = tscompile.LLM("llama-tiny", attention_backend=backend, device=device, dtype=torch.float32, max_num_seqs=4,
                        max_model_len=128, page_size=16, compile_options={"decode_ladder": (1, 2)})
    print(backend, "after init", dict(counters), flush=True)
    llm.generate([[5] * 11, [7] * 3], SamplingParams(max_new_tokens=3))
    print(backend, "after generate", dict(counters), flush=True)
    print("dynamo graph_break counters:", dict(torch._dynamo.utils.counters["graph_break"]), flush=True)
    print("dynamo frames:", dict(torch._dynamo.utils.counters["frames"]), flush=True)
    print("dynamo unimplemented:", dict(torch._dynamo.utils.counters["unimplemented"]), flush=True)
