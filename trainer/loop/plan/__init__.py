"""Pure plans from the config and the model: layout, model shape, memory budgets, call limits."""
