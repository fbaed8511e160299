"""The built-in chat workload: user questions sent through the model's chat template.

Shared by `llm-worker-bench --dataset chat` and `benchmarks.offline`, so both measure the
same requests. `pick_questions` draws them in a seeded order from its own random stream, so
the questions do not move when an output-length model changes.
"""

from __future__ import annotations

import numpy as np

# Varied user turns: everyday, coding, math, writing. Rendered through the chat template.
QUESTIONS = [
    # everyday
    "What is the capital of France?",
    "How do I get a red wine stain out of a white shirt?",
    "Why is the sky blue?",
    "What should I pack for a weekend camping trip?",
    "How long should I boil an egg for a runny yolk?",
    "Suggest three board games for a family with young kids.",
    "What is the difference between weather and climate?",
    "How often should I water a cactus?",
    "Give me a simple recipe for pancakes.",
    "What are some good stretches after a long run?",
    "How can I fall asleep faster at night?",
    "Why do leaves change color in the autumn?",
    "What is a good way to start learning a new language?",
    "Recommend a few classic novels for a teenager.",
    "How does a refrigerator keep food cold?",
    "What should I do if my phone gets wet?",
    # coding
    "Write a Python function that reverses a string.",
    "What is the difference between a list and a tuple in Python?",
    "Explain what a hash map is and when to use one.",
    "How do I read a CSV file with pandas?",
    "Write a SQL query that counts orders per customer.",
    "What does the `git rebase` command do?",
    "Write a JavaScript function that checks whether a number is prime.",
    "Explain recursion with a short example in Python.",
    "What is the difference between a process and a thread?",
    "How do I center a div with CSS?",
    "Write a bash one-liner that counts lines in all .py files in a folder.",
    "What is Big O notation?",
    "Explain what a REST API is in simple terms.",
    "Write a Python class for a stack with push, pop and peek.",
    "How do I handle exceptions in Python?",
    "What is a race condition and how can I avoid one?",
    # math
    "What is 17 times 23?",
    "Solve for x: 3x + 7 = 22.",
    "What is the derivative of x^3 + 2x?",
    "Explain the Pythagorean theorem with an example.",
    "What is the sum of the first 100 positive integers?",
    "Is 91 a prime number? Explain.",
    "Convert 0.375 to a fraction.",
    "What is the probability of rolling two sixes with two dice?",
    "How many seconds are there in a day?",
    "What is the area of a circle with radius 4?",
    "Explain what a logarithm is.",
    "If a train travels 120 km in 1.5 hours, what is its average speed?",
    "What is 15% of 240?",
    "Find the next number in the sequence 2, 6, 12, 20, 30.",
    "What is the square root of 144?",
    "Explain the difference between mean and median.",
    # writing
    "Write a haiku about autumn leaves.",
    "Write a short poem about the ocean.",
    "Write a two-sentence horror story.",
    "Draft a polite email asking my manager for a day off.",
    "Write a product description for a stainless steel water bottle.",
    "Write a limerick about a cat who loves to cook.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Write a short thank-you note to a teacher.",
    "Give me a catchy slogan for a bicycle shop.",
    "Write the opening paragraph of a mystery novel.",
    "Write a tweet announcing a new coffee shop opening.",
    "Describe a sunset to someone who has never seen one.",
    "Write a short bedtime story about a brave little turtle.",
    "Write a cover letter opening for a junior developer job.",
    "Write a motivational message for someone starting a new job.",
    "Write a short dialogue between a robot and a child.",
]


def pick_questions(n: int, seed: int) -> list[str]:
    """`n` questions: whole seeded permutations of QUESTIONS, back to back, cut at `n`."""
    rng = np.random.default_rng([seed, 1])
    order: list[int] = []
    while len(order) < n:
        order += rng.permutation(len(QUESTIONS)).tolist()
    return [QUESTIONS[i] for i in order[:n]]


def user_turn(question: str) -> list[dict[str, str]]:
    """The chat messages of one request: a single user turn."""
    return [{"role": "user", "content": question}]
