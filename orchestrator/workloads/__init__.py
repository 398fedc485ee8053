"""Models a job can name (the built-in GPT and Llama, Hugging Face configs, a user's factory),
how they travel to the workers, and the meta-device inspector that measures them for the planner."""
