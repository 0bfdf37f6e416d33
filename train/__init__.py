"""Draft-head training: recipes, data (chat and code, online or captured hidden states), the accelerate
trainer and `draftsmith capture` (`draftsmith datagen`, which runs the engine, is in serve). Each method's loss lives with the method
(`draftsmith.methods.<name>.objective`); this package holds what they share."""
