"""Accuracy and performance reports of the suite; scripts here write tables and plots, never assert."""
