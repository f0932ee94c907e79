"""Names that select code: the registry of implementations under test (contract §9) and of layout
families. The engine, the tests, the campaign and the reports all look names up here."""
