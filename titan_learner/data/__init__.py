"""The job's data: prompt files (`files`), the tokenizer and chat template (`tokenizer`), and the
torchdata loader that deals a step's prompts to data-parallel ranks and resumes exactly
(`loader`)."""
