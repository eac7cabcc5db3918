%% @private
%% `compress => auto', pure: per node, whether compressing what waits behind its
%% busy connection delivers more messages a second than not, found by measuring
%% both.
%%
%% Under `auto' a lane compresses only the batches of a node's busy run (from a
%% send that had to wait until a batch leaves the node's queue empty, see
%% `convoy_lane'), i.e. only while that node's connection is busy: a connection
%% that takes everything at once is not the limit, and compressing for it would
%% cost both nodes CPU for nothing. A busy connection is not enough, though: it is
%% busy as well when the receiving node's CPU is the limit, and there compressing
%% adds decoding to that CPU and slows everything. So the meter measures.
%%
%% Each batch of a busy run carries a meter (a barrier answered with the peer's
%% time, `convoy_wire:meter/2') whose answer comes back to the lane once the
%% peer's inbox has delivered everything before it (`answered/4');
%% the lane compresses it or not at the level of the node's mode when it builds
%% it (`level/2'). Answers in a row from one run time its batches' passage
%% through the slowest stage, whichever it is: the link, the lane compressing,
%% the peer decoding and delivering, or the lane and its senders (a run lasts
%% only while full chunks keep coming; if they come slower than the way takes them,
%% both modes measure that pace, and either does). Messages over that time is the
%% rate the mode in use gets, the peer's decoding included. Times are the
%% peer's (a node's measures are compared only with each other), taken as its
%% inbox delivered each chunk: a busy lane reading its answers late does not
%% bunch them. A measurement spans `SAMPLES' answers and `MIN_SPAN_US' at least,
%% long against the scheduling of two busy nodes, short against what a try
%% costs on a slow link.
%%
%% The meter uses one mode for the node's busy batches, `plain' at first, and
%% measures it over `SAMPLES' chunks; then it measures the other mode as long,
%% the first time at once, afterwards when `patience' times what its last try
%% took has passed (from taking it up to its measurement: what was on its way
%% first, and what is still on its way when it is measured, are part of the
%% cost, counted as the messages answered in that mode at its rate, so that a
%% pause of the senders costs nothing). Whichever delivered more messages a second
%% is used until then. Patience starts at `MIN_PATIENCE' and doubles (up to
%% `MAX_PATIENCE') each time the other mode loses again, and starts over when it
%% wins: trying the losing mode costs at most 1/`MIN_PATIENCE' of the time, less
%% the longer the choice holds, and a change of the link or of the load is found
%% within `MAX_PATIENCE' measurements' time. No threshold: two modes that deliver
%% alike cost alike whichever is used (doc/decisions.md).
-module(convoy_compress_auto).

-export([new/0, level/2, answered/4, summary/1]).

-export_type([meters/0, tag/0, mode/0]).

%% Chunks and time measured per measurement of a mode.
-define(SAMPLES, 8).
-define(MIN_SPAN_US, 20000).
-define(MIN_PATIENCE, 16).
-define(MAX_PATIENCE, 256).
%% The zlib level `auto' compresses at: level 1 delivered more than 6 both where
%% the link was the limit and where it was not (doc/decisions.md).
-define(LEVEL, 1).

-type mode() :: plain | zip.

-record(meter, {mode = plain :: mode(),
                %% the mode that delivered more when last measured against the other
                choice = plain :: mode(),
                %% per mode, the messages and microseconds of its last measure (of
                %% the chosen mode, all of them since it was taken up in the same
                %% run), and that run
                rates = #{} :: #{mode() => {pos_integer(), pos_integer(), reference()}},
                %% the mode in use was just taken up: its first measure is the way
                %% changing over (`warm', thrown away), then it starts anew (`fresh')
                stretch = warm :: warm | fresh | on,
                %% the mode being tried (or whose try is being answered) and its
                %% messages answered so far
                trial = none :: none | {mode(), non_neg_integer()},
                %% chunks, messages and microseconds measured so far in `mode'
                acc = {0, 0, 0} :: {non_neg_integer(), non_neg_integer(), non_neg_integer()},
                %% the last answer: its run, batch and when it came
                last = none :: none | {reference(), non_neg_integer(), integer()},
                %% when the mode not chosen is measured again: set once both were,
                %% `pending' until the lots of its last try are all answered
                retry_at = none :: none | pending | integer(),
                patience = ?MIN_PATIENCE :: pos_integer(),
                %% answers taken (for `summary/1')
                answers = 0 :: non_neg_integer()}).

-opaque meters() :: #{node() => #meter{}}.
%% What a batch's meter carries back: its run (a reference per busy run), its
%% number in the run, its mode and its messages.
-type tag() :: {reference(), pos_integer(), mode(), pos_integer()}.

%% @doc No node measured yet.
-spec new() -> meters().
new() -> #{}.

%% @doc The level `Node''s busy batches are compressed at now (`never': plain);
%% the node is measured from now on.
-spec level(node(), meters()) -> {never | 1..9, meters()}.
level(Node, Meters) ->
    case Meters of
        #{Node := #meter{mode = Mode}} -> {mode_level(Mode), Meters};
        _ -> {mode_level(plain), Meters#{Node => #meter{}}}
    end.

mode_level(zip) -> ?LEVEL;
mode_level(plain) -> never.

%% @doc `Node''s inbox answered the meter tagged `Tag' at `Now' (its time, in
%% microseconds). Returns the meters and, when the mode in use for the node
%% changed, its level (for the node's next busy batches) and, when the mode chosen changed,
%% the new one with both modes' last rates (messages a second).
-spec answered(node(), tag(), integer(), meters()) ->
          {meters(), none | {level, never | 1..9}
                   | {chosen, mode(), never | 1..9, #{mode() => float()}}}.
answered(Node, {Run, Seq, Mode, Msgs}, Now, Meters)
  when is_reference(Run), is_integer(Seq), is_integer(Msgs), Msgs > 0,
       is_map_key(Node, Meters) ->
    M = #meter{last = Last, answers = K} = maps:get(Node, Meters),
    M1 = tried(Mode, Msgs, Now, M#meter{last = {Run, Seq, Now}, answers = K + 1}),
    case Last of
        {_, _, At} when Now < At ->
            %% the peer's clock went back: another incarnation, measured anew
            {Meters#{Node => #meter{last = {Run, Seq, Now}, answers = K + 1}},
             case M#meter.mode of
                 zip -> {level, never};
                 plain -> none
             end};
        {Run, Prev, At} when Prev =:= Seq - 1, Mode =:= M#meter.mode ->
            measured(Node, Run, {Msgs, Now - At}, Now, Meters#{Node => M1});
        {Run, _, _} ->
            {Meters#{Node => M1}, none};
        _ ->
            %% another run: what the last one measured was another busy time
            {Meters#{Node => M1#meter{acc = {0, 0, 0}}}, none}
    end;
answered(_Node, _Tag, _Now, Meters) ->
    {Meters, none}.

%% A try's messages are counted until the first answer in the mode in use after
%% it: then every lot of the try is delivered. The next try takes as many
%% messages in the mode not in use, at its rate: it comes patience times that
%% later.
tried(Mode, Msgs, _Now, M = #meter{trial = {Mode, T}, retry_at = pending, mode = Current})
  when Mode =/= Current ->
    M#meter{trial = {Mode, T + Msgs}};
tried(Mode, _Msgs, Now, M = #meter{trial = {_, T}, retry_at = pending, mode = Mode,
                                   rates = Rates, patience = P}) ->
    {Ms, Us, _} = maps:get(other(Mode), Rates),
    M#meter{trial = none, retry_at = Now + P * (T * Us div Ms)};
tried(Mode, Msgs, _Now, M = #meter{trial = {Mode, T}}) ->
    M#meter{trial = {Mode, T + Msgs}};
tried(_Mode, _Msgs, _Now, M) ->
    M.

%% @doc Per measured node, its mode now and how many answers it took.
-spec summary(meters()) -> #{node() => #{mode := mode(), answers := non_neg_integer()}}.
summary(Meters) ->
    maps:map(fun(_Node, #meter{mode = Mode, answers = K}) -> #{mode => Mode, answers => K} end,
             Meters).

%% One chunk's passage, `Us' microseconds, in the mode in use. A mode's first
%% measure after it was taken up is thrown away (the lots of the other mode
%% still on their way, and the link's and the peer's buffers, make it say more of
%% the change than of the mode); the chosen mode's measures add up while it
%% stays in use in the same run, and the other mode's one measure (its
%% second) is set against them.
measured(Node, Run, {Msgs, Us}, Now, Meters) ->
    M = #meter{acc = {N, Ms, U}, mode = Mode, rates = Rates, stretch = Stretch} =
        maps:get(Node, Meters),
    case N + 1 < ?SAMPLES orelse U + Us < ?MIN_SPAN_US of
        true ->
            {Meters#{Node => M#meter{acc = {N + 1, Ms + Msgs, U + Us}}}, none};
        false when Stretch =:= warm ->
            {Meters#{Node => M#meter{acc = {0, 0, 0}, stretch = fresh}}, none};
        false ->
            Measure = case Rates of
                          #{Mode := {Ms0, U0, Run}} when Stretch =:= on ->
                              {Ms0 + Ms + Msgs, U0 + U + Us, Run};
                          _ ->
                              {Ms + Msgs, U + Us, Run}
                      end,
            M1 = M#meter{acc = {0, 0, 0}, rates = Rates#{Mode => Measure}, stretch = on},
            M2 = decide(Mode, Now, M1),
            {Meters#{Node => M2}, change(M, M2)}
    end.

%% What the lane is told: the busy batches' level when the mode in use changed, and
%% the rates when the mode chosen did.
change(#meter{mode = Mode, choice = Choice}, #meter{mode = Mode, choice = Choice}) ->
    none;
change(#meter{choice = Choice}, #meter{mode = Mode, choice = Choice}) ->
    {level, mode_level(Mode)};
change(_Before, #meter{mode = Mode, choice = Chosen, rates = Rates}) ->
    {chosen, Chosen, mode_level(Mode), maps:map(fun(_, {Ms, Us, _}) -> Ms * 1.0e6 / Us end, Rates)}.

%% The chosen mode measured again: the other is measured next when it never was,
%% or when its time has come.
decide(Mode, Now, M = #meter{choice = Mode, retry_at = At}) ->
    case At of
        pending -> M;
        _ when is_integer(At), Now < At -> M;
        _ -> M#meter{mode = other(Mode), trial = {other(Mode), 0}, stretch = warm}
    end;
%% The other mode measured: the one that delivered more is used until the other's
%% next turn. Measures in different runs are not set against each other
%% (the load may have changed between them): the chosen mode is measured again,
%% and the other right after.
decide(Mode, _Now, M = #meter{choice = Choice, rates = Rates, patience = P}) ->
    case Rates of
        #{Mode := {Ms, Us, C}, Choice := {ChoiceMs, ChoiceUs, C}} ->
            {Chosen, P1} = case Ms * ChoiceUs > ChoiceMs * Us of
                               true -> {Mode, ?MIN_PATIENCE};
                               false -> {Choice, min(2 * P, ?MAX_PATIENCE)}
                           end,
            M#meter{mode = Chosen, choice = Chosen, patience = P1, retry_at = pending,
                    stretch = warm};
        _ ->
            M#meter{mode = Choice, trial = none, retry_at = none, stretch = warm}
    end.

other(plain) -> zip;
other(zip) -> plain.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

%% Answers to node n@h from run `Ref' for batches From..To in `Mode', each of
%% 1,000 messages taking `Us' microseconds. Returns the meters, the time and the
%% changes.
answers(Ref, Lots, Mode, Us, {Ms0, T0}) ->
    lists:foldl(fun(Lot, {Ms, T, Changes}) ->
                        T1 = T + Us,
                        {Ms1, Change} = answered(n@h, {Ref, Lot, Mode, 1000}, T1, Ms),
                        {Ms1, T1, [Change || Change =/= none] ++ Changes}
                end, {Ms0, T0, []}, Lots).

mode(Ms) -> maps:get(mode, maps:get(n@h, summary(Ms))).

%% K windows of SAMPLES lots each, after lot Last.
lots(Last, K) -> lists:seq(Last + 1, Last + K * ?SAMPLES).

starts_plain_and_tries_zip_test() ->
    Ref = make_ref(),
    {never, Ms0} = level(n@h, new()),
    ?assertEqual(plain, mode(Ms0)),
    %% a first answer only sets where the next measure starts; the first window
    %% of a mode is thrown away
    {Ms1, T1, []} = answers(Ref, [1 | lots(1, 1)], plain, 5000, {Ms0, -1000000}),
    ?assertEqual(plain, mode(Ms1)),
    %% SAMPLES chunks measured in plain (MIN_SPAN_US and more): zip is tried at once
    {Ms2, T2, [{level, 1}]} = answers(Ref, lots(1 + ?SAMPLES, 1), plain, 5000, {Ms1, T1}),
    ?assertEqual(zip, mode(Ms2)),
    %% zip delivers twice as fast: chosen after its second window, with both
    %% rates (messages a second)
    {Ms3, _, [{chosen, zip, 1, Rates}]} =
        answers(Ref, lots(1 + 2 * ?SAMPLES, 2), zip, 2500, {Ms2, T2}),
    ?assertEqual(#{plain => 2.0e5, zip => 4.0e5}, Rates),
    ?assertEqual(zip, mode(Ms3)).

%% Answers too close together measure nothing yet: the measure spans MIN_SPAN_US.
spans_min_time_test() ->
    Ref = make_ref(),
    {_, Ms0} = level(n@h, new()),
    {Ms1, T1, []} = answers(Ref, [1 | lots(1, 4)], plain, 100, {Ms0, 0}),
    ?assert(T1 < ?MIN_SPAN_US),
    {_, _, [{level, 1}]} = answers(Ref, lists:seq(2 + 4 * ?SAMPLES, 1 + 4 * ?SAMPLES + 400),
                                   plain, 100, {Ms1, T1}).

keeps_plain_when_zip_is_slower_test() ->
    Ref = make_ref(),
    {_, Ms0} = level(n@h, new()),
    {Ms1, T1, _} = answers(Ref, [1 | lots(1, 2)], plain, 5000, {Ms0, 0}),
    ?assertEqual(zip, mode(Ms1)),
    {Ms2, T2, [{level, never}]} = answers(Ref, lots(1 + 2 * ?SAMPLES, 2), zip, 7500, {Ms1, T1}),
    ?assertEqual(plain, mode(Ms2)),
    %% plain measured again and again: zip is not tried before its turn...
    {Ms3, T3, []} = answers(Ref, lots(1 + 4 * ?SAMPLES, 4), plain, 5000, {Ms2, T2}),
    ?assertEqual(plain, mode(Ms3)),
    %% ...which comes MIN_PATIENCE * 2 times what trying it cost later: its
    %% 2 * SAMPLES lots at zip's rate, counted from the first plain answer after it
    Later = T2 + 5000 + ?MIN_PATIENCE * 2 * 2 * ?SAMPLES * 7500,
    ?assert(Later > T3),
    {Ms4, _, [{level, 1}]} = answers(Ref, lots(1 + 8 * ?SAMPLES, 1), plain, 5000, {Ms3, Later}),
    ?assertEqual(zip, mode(Ms4)).

%% Answers that time nothing: a batch not next to the last answered, another
%% run's, a lot sent in the mode left; and tags that are not the meter's.
ignores_what_measures_nothing_test() ->
    Ref = make_ref(),
    {_, Ms0} = level(n@h, new()),
    {Ms1, T1, []} = answers(Ref, [1], plain, 100, {Ms0, 0}),
    Unchanged = fun(Tag, Ms) ->
                        {Ms2, none} = answered(n@h, Tag, T1 + 100, Ms),
                        #meter{acc = Acc} = maps:get(n@h, Ms2),
                        ?assertEqual({0, 0, 0}, Acc),
                        Ms2
                end,
    _ = Unchanged({Ref, 3, plain, 1000}, Ms1),
    _ = Unchanged({make_ref(), 2, plain, 1000}, Ms1),
    _ = Unchanged({Ref, 2, zip, 1000}, Ms1),
    ?assertEqual({Ms1, none}, answered(n@h, {Ref, 2, plain, 0}, T1 + 100, Ms1)),
    ?assertEqual({Ms1, none}, answered(n@h, not_a_tag, T1 + 100, Ms1)),
    ?assertEqual({Ms1, none}, answered(other@h, {Ref, 2, plain, 1000}, T1 + 100, Ms1)),
    ?assertEqual(#{n@h => #{mode => plain, answers => 1}}, summary(Ms1)).

%% The peer's clock going back (it restarted) starts its meter anew, plain.
clock_back_test() ->
    Ref = make_ref(),
    {_, Ms0} = level(n@h, new()),
    {Ms1, T1, [{level, 1}]} = answers(Ref, [1 | lots(1, 2)], plain, 5000, {Ms0, 0}),
    ?assertEqual(zip, mode(Ms1)),
    {Ms2, {level, never}} = answered(n@h, {make_ref(), 1, zip, 1000}, T1 - 1000000, Ms1),
    ?assertEqual(plain, mode(Ms2)),
    ?assertMatch(#meter{rates = R, retry_at = none} when map_size(R) =:= 0, maps:get(n@h, Ms2)).
-endif.
