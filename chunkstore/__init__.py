"""The data plane: chunking, chunk ids, codecs, placement over object nodes."""
