"""Models and data a job can name. Imports torch only, never the orchestrator runtime."""
