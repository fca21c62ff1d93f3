"""Page images ready for the model: rendering (render), the orientation check (orientation), ink measures (ink), a
chunk's pages prepared (prepare) with the model's inputs (inputs), in processes of their own (pool, its processes:
prepare_process, handing back through shared memory: shm) and ahead of the decoder (prefetch).

May import the top modules, engine/ and db/."""
