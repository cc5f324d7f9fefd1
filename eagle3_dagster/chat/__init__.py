"""Chat formats: how conversations become the exact text a target model sees and generates."""
