"""HTTP serving over one Engine: the app, the OpenAI and Anthropic routes, their shared HTTP helpers, log-probabilities,
the engine thread behind the routes, and persistent sessions."""
