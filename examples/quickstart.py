import pipedialect
from pipedialect.demo import demo_batches
from pipedialect.models import TinyGPT, cross_entropy_loss

model = TinyGPT(vocab=48, dim=32, max_len=16, num_blocks=8)     # any nn.Module
plan = pipedialect.partition(model, split_points=["blocks.3"])  # two stages
dialect = pipedialect.get_dialect("deepspeed")
dialect.init_distributed()                                      # gloo on CPUs, NCCL on GPUs
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
          "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}}}
module = dialect.pipe_engine(plan, config=config, loss_fn=cross_entropy_loss,
                             topology=dialect.make_topology(num_stages=2))
engine = dialect.runtime_engine(module, config=config)          # DeepSpeed's PipelineEngine
data = iter(demo_batches(20 * 4, replica=0))                    # (input_ids, labels) pairs
for step in range(20):
    print(f"step {step}: loss {engine.train_batch(data).item():.4f}")
