"""What a decoded page says: its text (text), its words with boxes (words) and their confidences (confidence).

May import pages/, the top modules, engine/ and db/."""
