"""Applications built on mbs_ext: the command line, the demo, the papers' Table 4 and their data.

They use only the public API and carry their own optional dependencies (tqdm, matplotlib,
scikit-learn, torchvision); the core package never imports them.
"""
