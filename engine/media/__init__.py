"""Images and videos: where their bytes come from, decoding and preprocessing for the vision tower, and their place
(placeholders, merged tokens, 3-D positions) in a prompt."""
