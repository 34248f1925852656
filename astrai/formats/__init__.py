"""What the workflows' files share: common pieces (``common``: names, counts, the machine
model, atomic writes), the workload and lock documents (``documents``), the values saved as
them (``saved``) and the JSON Schemas of every file astrai reads (``schemas``)."""
