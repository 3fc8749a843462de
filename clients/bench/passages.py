"""Passages for the quoting workload (``--dataset quote``): plain prose,
written for this benchmark, that a prompt asks the model to repeat or edit.
Speculative decoding drafts from the prompt, so the answer's tokens are
mostly the passage's own."""

from __future__ import annotations

PASSAGES = (
    "The lighthouse on the northern cape was built in 1871 from granite quarried two "
    "miles inland. Its lamp burned whale oil for the first decade, then kerosene, and "
    "since 1934 it has run on electricity from a cable laid across the bay. The keeper's "
    "house beside it is now a small museum that opens on weekends from May to September.",
    "To replace the filter, first switch off the pump and close both valves. Unscrew the "
    "housing by turning it counterclockwise, lift out the old cartridge, and rinse the "
    "housing with clean water. Insert the new cartridge with the arrow pointing down, "
    "screw the housing back on by hand, open the valves, and run the pump for five "
    "minutes before checking for leaks.",
    "Our quarterly results show revenue of 4.2 million dollars, up eleven percent from "
    "the same quarter last year. Operating costs rose by six percent, mostly from new "
    "hires in the support team. The board approved a dividend of twelve cents per share, "
    "payable on the fifteenth of next month to shareholders of record at the end of this "
    "month.",
    "Bees find flowers by colour and scent, and they remember where the best ones are. "
    "A forager that finds a rich patch returns to the hive and dances: the angle of the "
    "dance tells the direction of the patch relative to the sun, and its length tells the "
    "distance. Other workers follow the dance and fly straight to the flowers.",
    "The meeting is moved from Tuesday to Thursday at ten in the morning, in the large "
    "conference room on the third floor. Please bring the draft budget and your notes on "
    "the supplier contracts. If you cannot attend, send your comments to the project "
    "office by Wednesday evening so they can be read out at the start of the meeting.",
    "Bread needs only flour, water, salt and yeast. Mix the flour and water and let them "
    "rest for half an hour, then add the salt and yeast and knead for ten minutes until "
    "the dough is smooth. Let it rise until doubled, shape it into a loaf, let it rise "
    "again, and bake it in a hot oven for about forty minutes.",
    "The river rises in the hills to the west and flows east for two hundred kilometres "
    "before it reaches the sea. Three towns stand on its banks, each at a place where an "
    "old road once crossed it by a ford. In spring the snowmelt makes it wide and fast, "
    "and in late summer it is shallow enough to wade across in many places.",
    "Passwords should be long rather than complicated. A phrase of four or five ordinary "
    "words is easier to remember and harder to guess than a short string of symbols. Use "
    "a different password for every account, keep them in a password manager, and turn "
    "on a second factor wherever the service offers one.",
)

# What the prompt asks for; {passage} is replaced by one of the passages.
INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word:\n\n{passage}",
    "Copy this text without changing anything:\n\n{passage}",
    "Rewrite the passage below, keeping every sentence as it is but putting it in "
    "quotation marks:\n\n{passage}",
    "Here is a passage:\n\n{passage}\n\nWrite it out again, unchanged.",
)
