"""Using a trained model: loading, export, evaluation, generation, chat, serving."""
