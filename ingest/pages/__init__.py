"""Page images ready for the model: rendering (render), the orientation probe (orientation), ink measures (ink), the
processor step (prepare) and preparing ahead of the decoder (prefetch).

May import the top modules, engine/ and db/."""
