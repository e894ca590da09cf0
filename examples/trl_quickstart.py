from datasets import Dataset
from trl import GRPOConfig

from branchreplay.models import model_folder
from branchreplay.trl import TreeGRPOTrainer  # was: from trl import GRPOTrainer


def brevity(completions, **kwargs):  # TRL's reward signature: one float per completion
    return [-len(c) / 100.0 for c in completions]


dataset = Dataset.from_dict({"prompt": ["Calculate 2 + 3.", "Calculate 7 - 4."] * 2})
args = GRPOConfig(output_dir="runs/trl-quickstart", bf16=False, use_cpu=True, max_steps=1, save_strategy="no",
                  per_device_train_batch_size=4, num_generations=4, max_completion_length=16, logging_steps=1,
                  report_to="none")
trainer = TreeGRPOTrainer(model=model_folder("smollm2"), reward_funcs=brevity, args=args, train_dataset=dataset)
trainer.train()
