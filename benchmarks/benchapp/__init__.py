"""A tiny app for the fenced-write benchmark: one FencedModel, tables made by syncdb."""
