"""The seed's offline example, on the models this machine has.

Target Gemma 3 270M, draft SmolLM2-135M-Instruct: different tokenizers, so Token-Level
Intersection is on (as in the seed's §6 example). Prints the outputs and the spec-decode stats.
"""
from engine import LLM, SamplingParams

prompts = ["The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64)

llm = LLM(
    model="google/gemma-3-270m",
    tensor_parallel_size=1,
    speculative_config={
        "method": "draft_model",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "num_speculative_tokens": 3,
        "use_heterogeneous_vocab": True,
    },
)
outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
stats = llm.spec_decode_stats
print(f"spec decode: drafts={stats.num_drafts} draft_tokens={stats.num_draft_tokens} "
      f"accepted={stats.num_accepted_tokens} mean_acceptance_length={stats.mean_acceptance_length:.2f}")
