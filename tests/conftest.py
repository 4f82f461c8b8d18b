import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
