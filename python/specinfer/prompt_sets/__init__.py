"""The shipped prompt sets (code completion, code editing, summarization, QA, chat), shared by the
benchmarks (specinfer.bench) and head training (specinfer.training): loading, the chat-template
encoding every method receives, and how the sets were derived (build.py)."""
from specinfer.prompt_sets.encoding import prompt_encoder
from specinfer.prompt_sets.sets import DATA_DIR, INPUT_GROUNDED, TASKS, PromptSet, load_prompt_set, load_prompt_sets, load_task

__all__ = ["DATA_DIR", "INPUT_GROUNDED", "TASKS", "PromptSet", "load_prompt_set", "load_prompt_sets", "load_task",
           "prompt_encoder"]
