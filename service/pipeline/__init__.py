"""A request's way to the core: validate, tokenise, budget the answer, shape the outputs."""
